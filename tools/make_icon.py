"""Draw docs/img/icon.png, the Comfy Registry icon (`[tool.comfy] Icon`): 400×400, a UNet whose blocks are slimmed.

    .venv/bin/python tools/make_icon.py
"""
import argparse
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

SIZE = 400
BACK, BLOCK, SKIP, MIDDLE, TEXT = (24, 32, 48, 255), (88, 166, 255, 255), (120, 200, 140, 255), (255, 196, 86, 255), \
    (235, 240, 248, 255)


def draw(out: Path):
    img = Image.new("RGBA", (SIZE, SIZE), (0, 0, 0, 0))
    d = ImageDraw.Draw(img)
    d.rounded_rectangle([0, 0, SIZE - 1, SIZE - 1], radius=72, fill=BACK)
    width = 58
    for level, y in enumerate((70, 125, 180, 235)):          # encoder (left) and decoder (right) blocks, hollowed
        left, right = 52 + level * 22, SIZE - 52 - level * 22 - width
        for x in (left, right):
            d.rounded_rectangle([x, y, x + width, y + 40], radius=10, fill=BLOCK)
            d.rounded_rectangle([x + 16, y + 8, x + width - 16, y + 32], radius=6, fill=BACK)
        d.line([left + width, y + 20, right, y + 20], fill=SKIP, width=5)     # skip connections
    d.rounded_rectangle([SIZE // 2 - 45, 292, SIZE // 2 + 45, 332], radius=10, fill=MIDDLE)
    try:
        font = ImageFont.truetype("DejaVuSans-Bold.ttf", 46)
    except OSError:
        font = ImageFont.load_default()
    d.text((SIZE // 2, 368), "sdslim", fill=TEXT, font=font, anchor="mm")
    img.save(out, optimize=True)
    print(f"wrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "img" / "icon.png")
    draw(ap.parse_args().out)


if __name__ == "__main__":
    main()
