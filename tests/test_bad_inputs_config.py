"""Config values the model and the converter would otherwise ignore or trip on (docs/bad_inputs.md, "Config values")."""
