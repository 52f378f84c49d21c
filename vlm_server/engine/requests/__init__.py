"""Request -> prompt tokens + grammar: one definition of each task (prompts, limits)."""
