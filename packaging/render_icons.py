"""Renders resources/icons/kvboost.svg into the PNGs, the Windows .ico and the macOS .icns next to it.

    .venv/bin/python packaging/render_icons.py

Run it after editing the SVG and commit the results: the builds read the rendered files and never render. The
PNGs come from Qt's SVG renderer (PySide6, already a dependency); the .ico and .icns are packed by Pillow
(installed with the dev extra's fpdf2), from the PNGs of the sizes each format holds.
"""

from __future__ import annotations

import sys
from pathlib import Path

ICONS = Path(__file__).resolve().parents[1] / "resources" / "icons"
PNG_SIZES = (16, 32, 48, 64, 128, 256, 512)
ICO_SIZES = (16, 32, 48, 64, 128, 256)  # 256 is the largest an .ico holds
ICNS_SIZES = (16, 32, 64, 128, 256, 512)


def render_pngs(svg: Path) -> dict[int, Path]:
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    app = QGuiApplication.instance() or QGuiApplication(["render_icons", "-platform", "offscreen"])
    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise SystemExit(f"{svg} is not a valid SVG")
    written = {}
    for size in PNG_SIZES:
        image = QImage(size, size, QImage.Format_ARGB32)
        image.fill(Qt.transparent)
        painter = QPainter(image)
        painter.setRenderHint(QPainter.Antialiasing)
        renderer.render(painter)
        painter.end()
        out = svg.with_name(f"kvboost-{size}.png")
        if not image.save(str(out)):
            raise SystemExit(f"could not write {out}")
        written[size] = out
    del app
    return written


def pack(pngs: dict[int, Path]) -> None:
    from PIL import Image

    ico = [Image.open(pngs[s]).convert("RGBA") for s in ICO_SIZES]
    ico[-1].save(ICONS / "kvboost.ico", sizes=[(s, s) for s in ICO_SIZES], append_images=ico[:-1])
    icns = [Image.open(pngs[s]).convert("RGBA") for s in ICNS_SIZES]
    icns[-1].save(ICONS / "kvboost.icns", append_images=icns[:-1])


def main() -> int:
    pngs = render_pngs(ICONS / "kvboost.svg")
    pack(pngs)
    print(f"wrote {len(pngs)} PNGs, kvboost.ico and kvboost.icns in {ICONS.name}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
