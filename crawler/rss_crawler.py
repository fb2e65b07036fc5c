"""python -m crawler.rss_crawler ... is python vesti.py rss ..."""
import sys

import vesti

raise SystemExit(vesti.main(["rss", *sys.argv[1:]]))
