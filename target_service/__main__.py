"""python -m target_service"""
from target_service.cli import main

main()
