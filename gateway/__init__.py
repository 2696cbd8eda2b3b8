"""The service: transport, admission, scheduling, model repository, CLI."""
