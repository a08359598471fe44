"""One module per recovery plan: how the pipeline changes and how the KV comes back. The
coordinator (`vllm.resilience.coordinator`) picks the plan; a new recovery behaviour is a new
module here and its tests beside the others'."""
