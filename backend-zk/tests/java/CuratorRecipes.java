// Drives Apache Curator's InterProcessSemaphoreV2 and InterProcessReadWriteLock for
// fencelock's interop tests, one command per line on stdin, one answer line each.
//
// Usage: CuratorRecipes CONNECT_STRING SEMAPHORE_PATH LIMIT RW_PATH
//
// Commands:
//   SEM_ACQUIRE MS     take one lease, waiting up to MS ms: ACQUIRED or TIMEOUT
//   SEM_RELEASE        return the last lease taken: RELEASED
//   SEM_LOOP N REG     N rounds of: take a lease, add one to the holder count in the
//                      register REG ("holders:total", written with a version check),
//                      OVER if it passes LIMIT, subtract one, return the lease: DONE
//   READ MS / WRITE MS take the read / write lock, waiting up to MS ms: ACQUIRED or TIMEOUT
//   UNREAD / UNWRITE   release it: RELEASED
import java.util.ArrayDeque;
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.util.concurrent.TimeUnit;

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessReadWriteLock;
import org.apache.curator.framework.recipes.locks.InterProcessSemaphoreV2;
import org.apache.curator.framework.recipes.locks.Lease;
import org.apache.curator.retry.RetryNTimes;
import org.apache.zookeeper.KeeperException;
import org.apache.zookeeper.data.Stat;

public class CuratorRecipes {
    static CuratorFramework client;
    static int limit;

    public static void main(String[] args) throws Exception {
        String connect = args[0];
        String semPath = args[1];
        limit = Integer.parseInt(args[2]);
        String rwPath = args[3];
        client = CuratorFrameworkFactory.newClient(connect, 10000, 5000, new RetryNTimes(3, 100));
        client.start();
        client.blockUntilConnected();
        InterProcessSemaphoreV2 semaphore = new InterProcessSemaphoreV2(client, semPath, limit);
        InterProcessReadWriteLock rw = new InterProcessReadWriteLock(client, rwPath);
        ArrayDeque<Lease> leases = new ArrayDeque<>();
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        System.out.println("READY");
        System.out.flush();
        String line;
        while ((line = in.readLine()) != null) {
            String[] cmd = line.trim().split(" ");
            String answer;
            switch (cmd[0]) {
                case "SEM_ACQUIRE": {
                    Lease lease = semaphore.acquire(Long.parseLong(cmd[1]), TimeUnit.MILLISECONDS);
                    if (lease == null) {
                        answer = "TIMEOUT";
                    } else {
                        leases.push(lease);
                        answer = "ACQUIRED";
                    }
                    break;
                }
                case "SEM_RELEASE":
                    semaphore.returnLease(leases.pop());
                    answer = "RELEASED";
                    break;
                case "SEM_LOOP": {
                    int rounds = Integer.parseInt(cmd[1]);
                    answer = "DONE";
                    for (int i = 0; i < rounds && answer.equals("DONE"); i++) {
                        Lease lease = semaphore.acquire();
                        try {
                            if (add(cmd[2], 1) > limit) {
                                answer = "OVER";
                            }
                            Thread.sleep(3);
                            add(cmd[2], -1);
                        } finally {
                            semaphore.returnLease(lease);
                        }
                    }
                    break;
                }
                case "READ":
                    answer = rw.readLock().acquire(Long.parseLong(cmd[1]), TimeUnit.MILLISECONDS)
                            ? "ACQUIRED" : "TIMEOUT";
                    break;
                case "WRITE":
                    answer = rw.writeLock().acquire(Long.parseLong(cmd[1]), TimeUnit.MILLISECONDS)
                            ? "ACQUIRED" : "TIMEOUT";
                    break;
                case "UNREAD":
                    rw.readLock().release();
                    answer = "RELEASED";
                    break;
                case "UNWRITE":
                    rw.writeLock().release();
                    answer = "RELEASED";
                    break;
                default:
                    answer = "UNKNOWN " + line;
            }
            System.out.println(answer);
            System.out.flush();
        }
        client.close();
    }

    // Adds delta to the holder count of the register "holders:total" (version-checked),
    // returning the new holder count.
    static long add(String register, int delta) throws Exception {
        while (true) {
            Stat stat = new Stat();
            String[] value = new String(client.getData().storingStatIn(stat).forPath(register)).split(":");
            long holders = Long.parseLong(value[0]) + delta;
            long total = Long.parseLong(value[1]) + (delta > 0 ? 1 : 0);
            try {
                client.setData().withVersion(stat.getVersion())
                        .forPath(register, (holders + ":" + total).getBytes());
                return holders;
            } catch (KeeperException.BadVersionException e) {
                // Another holder wrote in between: read again.
            }
        }
    }
}
