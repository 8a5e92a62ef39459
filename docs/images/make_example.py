"""Regenerate ``docs/images/transformer-fp16.png``, the README's example of ``fpaudit plot``.

    .venv/bin/python docs/images/make_example.py

It draws what ``fpaudit plot REPORT -o transformer-fp16.png --format fp16`` draws
for a 2-step scan of the sample transformer (CPU, seed 0) at the recommended fp16
scale, then stores it with a 256-colour palette so that the README stays light
(the plot has few colours; the palette loses nothing visible).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from PIL import Image

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TARGET = HERE / "transformer-fp16.png"


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from fpaudit.cli.plot import plot_report
    from fpaudit.run.scan import ScanOptions, scan

    report = scan(ROOT / "sample_configs" / "transformer.py", ScanOptions(steps=2, device="cpu"))
    with tempfile.TemporaryDirectory() as scratch:
        full = plot_report(report, Path(scratch) / "full.png", "fp16")
        with Image.open(full) as image:
            small = image.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT)
            partial = TARGET.with_name(f".{TARGET.name}.tmp")
            small.save(partial, format="PNG", optimize=True)
        os.replace(partial, TARGET)
    print(f"wrote {TARGET.relative_to(ROOT)} ({TARGET.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
