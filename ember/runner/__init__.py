"""The bridge from a SchedulerOutput to tensors, the model and the sampler."""
