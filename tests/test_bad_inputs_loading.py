"""Loading a folder with from_pretrained: which files a folder may name (docs/bad_inputs.md, "Loading a folder")."""
