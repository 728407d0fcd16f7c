"""The configuration: its keys, presets and validation (schema), its sections (sections), the DeepSpeed policy table
(ds_policy), a user's DeepSpeed JSON mapped onto those keys (ds_config), and the one resolution of a run's config
(resolve: presets, DeepSpeed, one validation, frozen)."""
