"""python -m crawler.worker ... is python vesti.py worker ..."""
import sys

import vesti

raise SystemExit(vesti.main(["worker", *sys.argv[1:]]))
