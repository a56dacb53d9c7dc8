"""`pipeline doctor`: checks of a cluster before a long run (checks: one host; cluster: every host, compared)."""
