"""python -m crawler.telegram_crawler ... is python vesti.py telegram ..."""
import sys

import vesti

raise SystemExit(vesti.main(["telegram", *sys.argv[1:]]))
