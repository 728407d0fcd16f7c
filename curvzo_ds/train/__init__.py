"""A training job: built in one place, its loop, evaluation, logs, pre-emption, and the Accelerate and Trainer front
ends."""
