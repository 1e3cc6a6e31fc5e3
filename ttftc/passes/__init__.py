"""Graph passes, one per file, run in pipeline order by manager.PassManager."""
