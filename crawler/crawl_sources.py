"""python -m crawler.crawl_sources ... is python vesti.py crawl ..."""
import sys

import vesti

raise SystemExit(vesti.main(["crawl", *sys.argv[1:]]))
