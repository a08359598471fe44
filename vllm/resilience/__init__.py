"""What happens when a pipeline stage fails, and every other change of the pipeline (shrink,
grow, reshape). Start at `coordinator.py`; docs/ARCHITECTURE.md has the map and the glossary."""
