"""(placeholder: registered by issue 27's work)"""
