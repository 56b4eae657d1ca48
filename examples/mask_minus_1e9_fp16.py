"""A causal mask added as -1e9, with left padding, diagnosed for an fp16 model.

-1e9 is not representable in fp16 (max 65504): it becomes -inf. Partly masked
rows survive, but the padded queries whose every key is masked turn from a
uniform row (fp32) into NaN (fp16): the classic left-padding + causal mask bug.

    python examples/mask_minus_1e9_fp16.py [OUTDIR]
"""

import numpy as np
from _common import diagnose_and_expect, output_dir

out = output_dir()
rng = np.random.default_rng(0)
t, pad = 16, 4
scores = rng.standard_normal((2, t, t)).astype(np.float32)  # (B, T, T), already scaled
future = np.triu(np.ones((t, t), dtype=bool), k=1)
scores[:, future] = -1e9  # causal mask as a float constant
scores[1, :, :pad] = -1e9  # batch 1 is left-padded: its first `pad` keys are padding
path = out / "causal_minus_1e9.npy"
np.save(path, scores)

diagnose_and_expect(str(path), {"sentinel_not_representable", "fully_masked_rows"}, "--brief")
