"""The format-2 tree blob's constants, shared by the one-blob codec (`codec`) and the batch decoder (`batch_codec`).

A private module with public names (as psycopg's `_copy_base.py`): both decoders read the same bit layout, so its
constants live once, here, and neither imports the other's private names.
"""

from __future__ import annotations

import numpy as np

MAX_NODES = 0xFFFF
RANKED = 0x01  # header flag: tokens are ranks in the store's `TokenTable`
CLASS_BITS = (4, 8, 12)  # token classes 0-2; class 3 takes the blob's widest width
CLASS_BASE = np.array([0, 16, 16 + 256, 16 + 256 + 4096], dtype=np.int64)  # [4] first rank of each class
PARENT_BITS = np.array([i.bit_length() for i in range(MAX_NODES + 1)], dtype=np.int64)  # parent + 1 <= i
MASKS = (np.int64(1) << np.arange(58, dtype=np.int64)) - 1  # [w] the low w bits, w <= 57
