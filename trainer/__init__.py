"""DFlash drafter trainer on top of dflash_kernels (see README, "Trainer").

The trainer never touches the network: the Hugging Face hub is switched to offline mode before
transformers is imported by any trainer module.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
