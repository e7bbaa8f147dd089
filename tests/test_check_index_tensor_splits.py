"""`symgrad check` sizes an index tensor read at a split position inside another read's
position: mmcv's tin_shift reads its shift per group of channels, `shift[b, c // CG]` with
`CG = x.shape[2] // shift.shape[1]`. The shift's channel axis was sized as a free axis (9
for 3 channels), so CG was 0 and the formula's forward raised "Integer division by zero":
a correct op reported FAIL. It is now sized as other split reads are (a divisor of the
channel count)."""

from __future__ import annotations

from symgrad.check import plan_sizes
from symgrad.cli import main
from symgrad.model import build
from symgrad.spec import parse_op

TIN_SHIFT = {
    "formula": "y[b,t,c,hw] = x[b, t + shift[b, c // CG], c, hw]",
    "let": {"CG": "x.shape[2] // shift.shape[1]"},
    "ranges": {"t": "x.shape[1]"},
}


def test_the_shift_of_a_group_of_channels_divides_the_channels():
    program = build(parse_op("TinShift", TIN_SHIFT, "symgrad.toml"))
    sizes = plan_sizes(program, {})
    channels, groups = sizes.shapes["x"][2], sizes.shapes["shift"][1]
    assert channels % groups == 0 and channels // groups >= 1, sizes.shapes


def test_check_passes_tin_shift(tmp_path, capsys):
    spec = tmp_path / "symgrad.toml"
    spec.write_text(
        'out = "gen"\n\n[ops.TinShift]\n'
        'formula = "y[b,t,c,hw] = x[b, t + shift[b, c // CG], c, hw]"\n'
        'let = { CG = "x.shape[2] // shift.shape[1]" }\n'
        'ranges = { t = "x.shape[1]" }\n',
        encoding="utf-8",
    )
    assert main(["generate", str(spec)]) == 0
    assert main(["check", str(spec)]) == 0, capsys.readouterr()
