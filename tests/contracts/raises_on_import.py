raise RuntimeError("this plugin module is broken at import")
