"""pilotrun.training: the loop and its callbacks, the session (fresh or resumed), checkpoint storage,
precision, signals and distribution: where tokens, a model and an optimizer become a trained run."""
