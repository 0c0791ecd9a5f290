"""orthosphere.workflows"""
