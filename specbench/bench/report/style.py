"""One look for every figure `make figures` writes: a fixed colour and marker per drafter (the same in every figure),
the drafter families the small multiples are cut by, one font size, and `save`, which writes each figure as a PNG and,
beside it, a vector PDF, both without time or version stamps (a re-run rewrites them byte for byte)."""
from __future__ import annotations

import zlib
from pathlib import Path

import matplotlib as mpl
import matplotlib.pyplot as plt

FONT_SIZE = 8  # every text of every figure: titles, labels, ticks, legends
DPI = 150      # the PNG's; the PDF is vector

# One (colour, marker) per conf/drafter/*.yaml name. Colours: tab10 plus three of tab20b's dark tones, one colour per
# drafter (13 hues and the baseline's black); markers differ too, so a figure printed in grey still tells them apart.
# Within a family (FAMILIES, one panel of the batch figure) the hues are far apart: sd blue / sd_tree cyan / pld grey,
# eagle red / eagle2 orange / eagle3 brown, hass green / coral purple / coral_router pink / beagle olive.
DRAFTERS: dict[str, tuple[str, str]] = {
    "none": ("#000000", "x"),
    "sd": ("#1f77b4", "o"),
    "sd_tree": ("#17becf", "s"),
    "pld": ("#7f7f7f", "D"),
    "eagle": ("#d62728", "o"),
    "eagle2": ("#ff7f0e", "s"),
    "eagle3": ("#8c564b", "^"),
    "hass": ("#2ca02c", "v"),
    "coral": ("#9467bd", "D"),
    "coral_router": ("#e377c2", "P"),
    "beagle": ("#bcbd22", "X"),
    "medusa": ("#393b79", "h"),
    "moa": ("#637939", "p"),
    "moa_tli1": ("#7b4173", "*"),
}

# A name not above (a new drafter, a training variant, a trainmem method) gets a pair from these by a hash of its name
# (crc32: the same on every run and machine, unlike hash()).
_FALLBACK_COLOURS = [mpl.colormaps["tab20"](i) for i in range(20)]
_FALLBACK_MARKERS = ["o", "s", "^", "v", "D", "P", "X", "h", "p", "*", "<", ">"]

# The batch figure's panels, in this order; a drafter in none of them gets a panel "other".
FAMILIES: dict[str, tuple[str, ...]] = {
    "independent draft / lookup": ("sd", "sd_tree", "pld"),
    "EAGLE head": ("eagle", "eagle2", "eagle3"),
    "EAGLE-head training variants": ("hass", "coral", "coral_router", "beagle"),
    "Medusa": ("medusa",),
    "MoA": ("moa", "moa_tli1"),
}

DATASETS = {"mtbench": "MT-Bench", "gsm8k": "GSM8K", "cnndm": "CNN/DM", "humaneval": "HumanEval", "alpaca": "Alpaca"}

# The two parts of a step in the cost figure (not drafters: their own two colours).
PARTS = {"draft": "#0072B2", "verify": "#E69F00"}
BASELINE = "#7f7f7f"  # a baseline's reference line

RC = {
    "font.size": FONT_SIZE, "axes.titlesize": FONT_SIZE, "axes.labelsize": FONT_SIZE, "xtick.labelsize": FONT_SIZE,
    "ytick.labelsize": FONT_SIZE, "legend.fontsize": FONT_SIZE, "legend.title_fontsize": FONT_SIZE,
    "figure.titlesize": FONT_SIZE, "figure.labelsize": FONT_SIZE, "axes.spines.top": False,
    "axes.spines.right": False, "axes.grid": True, "grid.linewidth": 0.4, "grid.alpha": 0.4, "lines.linewidth": 1.2,
    "lines.markersize": 4, "legend.frameon": False, "savefig.dpi": DPI, "pdf.fonttype": 42,  # TrueType in the PDF
}
PNG_META = {"Software": None}  # no version/time stamps: byte-identical re-runs
PDF_META = {"CreationDate": None, "Creator": None, "Producer": None}


def drafter_style(name: str) -> tuple[str, str]:
    """The drafter's (colour, marker): fixed for every conf/drafter name, from a hash of the name for any other."""
    if name in DRAFTERS:
        return DRAFTERS[name]
    h = zlib.crc32(name.encode())
    return mpl.colors.to_hex(_FALLBACK_COLOURS[h % len(_FALLBACK_COLOURS)]), _FALLBACK_MARKERS[h // 20 % 12]


def colour(name: str) -> str:
    return drafter_style(name)[0]


def marker(name: str) -> str:
    return drafter_style(name)[1]


def family(name: str) -> str:
    return next((f for f, names in FAMILIES.items() if name in names), "other")


def dataset_name(ds: str | None) -> str:
    return DATASETS.get(ds, ds) if ds else "?"


def apply() -> None:
    """The figures' rcParams (one font size); every figure is made through `subplots`, which applies them."""
    mpl.rcParams.update(RC)


def subplots(*args, **kwargs):
    """plt.subplots under the report's rcParams, with constrained layout (legends outside the axes kept in)."""
    apply()
    kwargs.setdefault("layout", "constrained")
    return plt.subplots(*args, **kwargs)


def save(fig, path: Path) -> None:
    """The figure as `path` (a .png) and as the vector PDF beside it, without timestamps; closes the figure."""
    path = Path(path)
    fig.savefig(path, dpi=DPI, metadata=PNG_META)
    fig.savefig(path.with_suffix(".pdf"), metadata=PDF_META)
    plt.close(fig)
