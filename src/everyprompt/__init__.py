"""everyprompt: RL post-training for LLM reasoning models, Mixture-of-Experts first.

Every prompt and every rollout should carry learning signal. See README.md for the two commands and
../docs for the guides.
"""

__version__ = "0.1.0"
