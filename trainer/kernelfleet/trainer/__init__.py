"""kernelfleet.trainer: the three stages that train a policy to write faster kernels.

Supervised fine-tuning on verified code, self-training, and contrastive RL with GRPO, all with
trl. The search loop they draw prompts and rewards from lives in `kernelfleet.search`.
"""
