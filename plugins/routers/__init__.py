"""Built-in routers: which data-parallel replica serves a request (``router=<name>``)."""
