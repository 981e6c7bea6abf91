"""Runtime: loading generated programs and running them."""
