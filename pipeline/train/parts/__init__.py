"""The parts the loop calls, each owning its interval: metrics, trackers, validation, guards. Imports
checkpoint/, setup/ and runtime/, never the loop."""
