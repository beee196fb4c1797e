from specserve.blockmgr.block_manager import BlockManager, BlockPool

__all__ = ["BlockManager", "BlockPool"]
