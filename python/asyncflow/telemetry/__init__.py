"""What a run records: worker timelines, per-step metrics, and the summary figure."""
