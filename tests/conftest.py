pytest_plugins = ["tests.cluster.fixtures", "tests.models.fixtures"]
