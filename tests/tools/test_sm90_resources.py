"""tools/studies/sm90_resources.py's count of the spills inside innermost loops, on a SASS excerpt (cuobjdump's
format: address comment, instruction, encoding comment)."""

from tools.studies.sm90_resources import inner_loop_spills


def _sass(*instructions):
    return "\n".join(f"        /*{addr:04x}*/                   {text} ;      /* 0x0000000000000000 */"
                     for addr, text in instructions)


def test_counts_only_the_innermost_loops():
    sass = _sass((0x00, "STL [R1+0x84], R2"),           # before any loop
                 (0x10, "LDL R3, [R1+0x84]"),           # outer loop: 0x10 .. 0x70
                 (0x20, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24"),
                 (0x30, "STL [R1+0x8], R5"),            # inner loop: 0x20 .. 0x50
                 (0x40, "LDL.LU R5, [R1+0x8]"),
                 (0x50, "@P6 BRA 0x20"),
                 (0x60, "STL [R1+0xc], R6"),            # outer only
                 (0x70, "@P5 BRA 0x10"),
                 (0x80, "LDL R7, [R1+0xc]"),            # after
                 (0x90, "@P0 BRA 0xa0"),                # a forward branch is no loop
                 (0xa0, "EXIT"))
    assert inner_loop_spills(sass) == 2
    assert inner_loop_spills(_sass((0x00, "STL [R1], R2"), (0x10, "EXIT"))) == 0
