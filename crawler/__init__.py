"""`python -m crawler.X` runs the matching vesti.py command; no logic here."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
