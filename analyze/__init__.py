"""orthosphere.analyze"""
