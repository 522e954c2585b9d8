"""Text in and out: tokenizer, incremental detokenizer and chat templates."""
