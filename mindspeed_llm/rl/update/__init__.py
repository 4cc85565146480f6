"""The update side of an iteration: the models of a stage and how they are trained.

`roles.py` (the models, loaded and placed), `lora.py`, `moe.py`, `recompute.py` (what model building adds for them),
`batch_plan.py` (one micro-batch plan per iteration), `passes.py` (the forward-only passes over an `Experience`),
`loss_closures.py` and `ppo_loop.py` (the losses and epochs x mini-batches), `engine.py` (micro-batches through
megatron's schedule), `trainable.py` (a trained model: its optimizer step, checkpoint state and offloading),
`optimizer_state.py` and `model_state.py` (its optimizer's and its model's state)."""
