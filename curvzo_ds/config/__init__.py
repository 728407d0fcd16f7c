"""The configuration: its keys, presets and validation (schema), the DeepSpeed policy table (ds_policy), and a user's
DeepSpeed JSON mapped onto those keys (ds_config)."""
