"""The web console and its sign-in."""
