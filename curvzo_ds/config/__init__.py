"""The configuration: its keys and validation (schema), the presets (presets), a config's key names, flat dict and
sources (fields), its sections (sections), the DeepSpeed policy table (ds_policy), a user's DeepSpeed JSON mapped onto
those keys (ds_config), and the one resolution of a run's config (resolve: presets, DeepSpeed, one validation,
frozen)."""
