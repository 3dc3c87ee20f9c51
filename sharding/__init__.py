"""Device meshes and the rules mapping the model's logical axis names to mesh axes."""
