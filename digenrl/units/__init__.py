"""Units of work: rollout and train units as plain functions any driver calls, and their types."""
