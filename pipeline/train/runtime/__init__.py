"""Where a run runs: process groups and collectives (dist), DeepSpeed's ops (ops), the nodes' environment files
(env), workarounds for DeepSpeed (ds_workarounds), weights on disk (weights). The bottom of train/: it imports none
of the rest, and evaluate/, doctor/ and the launcher borrow it."""
