"""python -m draft_service"""
from draft_service.cli import main

main()
