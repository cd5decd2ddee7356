"""Models and tokenizers created locally (nothing is downloaded)."""
