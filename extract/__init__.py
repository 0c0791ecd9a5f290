"""orthosphere.extract: models -> activations (model family, tasks, capture, batch jobs)."""
