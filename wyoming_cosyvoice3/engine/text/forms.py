"""Number forms that look the same in every language: phone numbers, versions, ranges,
grouped thousands. Patterns only; each language module reads a match with its own words
(:mod:`.lang_en`, :mod:`.lang_eu`, :mod:`.lang_cjk`).
"""

from __future__ import annotations

import re

PHONE = re.compile(
    r"(?<![0-9A-Za-z_+.,:/-])(?:"
    r"\+\d{1,3}(?:[ .-]?\(\d{1,4}\))?(?:[ .-]?\d{1,4}){2,5}"  # +49 170 1234567, +7 (912) 345-67-89
    r"|(?:8 ?)?\(\d{2,5}\)[ .-]?\d{2,4}(?:[ .-]\d{2,4}){1,3}"  # (555) 123-4567
    r"|\d{3}-\d{3}-\d{4}|\d{3}-\d{4}"  # 555-123-4567, 555-1234
    r"|0\d{1,4}(?:[ /-]\d{2,8}){1,4}"  # 0170 1234567, 06 12 34 56 78, 030/1234567
    r")(?![0-9A-Za-z_]|[.,:]\d|-\d)"
)
"""A phone number: with a country code, an area code in brackets, the US dash groups, or a
leading 0 and groups (the national forms of de, fr, it, es, ru). Read digit by digit, which is
how numbers of this length are said in every one of the nine languages; a bare digit run
("call 911") is read as a number instead. The patterns here look at ASCII letters and digits
around a match only: in Chinese and Japanese a number touches the characters around it
("请拨打+86 138 1234 5678。", "バージョン1.2.3が")."""

VERSION = re.compile(r"(?<![0-9A-Za-z_.,])\d+(?:\.\d+){2,}(?![0-9A-Za-z_]|\.\d)")
"""A dotted version or address with three or more parts ("1.2.3", "192.168.1.10")."""

RANGE_DASH = r"(?:[-–]|\s[-–]\s|—)"
"""The dash of a range "20-22", "8:00 – 17:30", "20—22": blanks on both sides or none ("3 -5"
is a number and a negative one; an em dash with blanks around it is a pause, "PM2,5 — 35")."""
