from triptych_operator.metrics_api.main import main

raise SystemExit(main())
