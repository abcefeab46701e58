"""Models written as pure functions over parameter pytrees."""
