"""One Pydantic model of a whole run: its sections, the defaults, YAML and ``--set`` overrides."""
