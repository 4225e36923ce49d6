"""The head: DiffusionServer (request state, dispatch, transfer coordination) and the HTTP API."""
