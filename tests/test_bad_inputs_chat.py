"""Chat messages and the tokenizer: message text never becomes a control token (docs/bad_inputs.md, "Chat and tokenizer")."""
