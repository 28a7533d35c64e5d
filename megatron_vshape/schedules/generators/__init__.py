"""The schedule families and the registry that names them (``registry.get_schedule``)."""
